.PHONY: demo test test-deploy test-deploy-faults test-under-load bench lint airflow
demo:  ## set up and run the whole DAG on the emulated fleet
	bash scripts/demo.sh
test:  ## set up and run the tests and the lint
	bash scripts/test.sh
test-deploy:  ## rehearse the GPU node's docker compose deployment end to end on a local dockerd; not part of CI
	bash scripts/test-deploy.sh
test-deploy-faults:  ## the rehearsal with the node's faults (services killed, restarted, a small /dev/shm, a full disk)
	DFLASH_DEPLOY_FAULTS=1 bash scripts/test-deploy.sh
test-under-load:  ## the tests with every core kept busy by a busy loop (they must not depend on the machine's pace)
	bash scripts/test-under-load.sh
bench:  ## set up and run every benchmark (bench/results/latest.{json,md}); not part of CI
	bash scripts/bench.sh
lint:
	.venv/bin/ruff check .
	.venv/bin/mypy
airflow:  ## start a local Airflow with the DAG and the report pages, print URL and login
	bash scripts/airflow.sh

.PHONY: sglang-locks check-sglang-locks
sglang-locks:  ## refresh SGLang's venv locks, deploy/sglang-locks/ (today's packages; docs/sglang-versions.md)
	bash scripts/lock-sglang-venv.sh
check-sglang-locks:  ## each lock resolves again to the same pins (also in the tests: tests/deploy/test_sglang_locks.py)
	bash scripts/lock-sglang-venv.sh --check
