.PHONY: demo test bench lint airflow
demo:  ## set up and run the whole DAG on the emulated fleet
	bash scripts/demo.sh
test:  ## set up and run the tests and the lint
	bash scripts/test.sh
bench:  ## set up and run every benchmark (bench/results/latest.{json,md}); not part of CI
	bash scripts/bench.sh
lint:
	.venv/bin/ruff check .
airflow:  ## start a local Airflow with the DAG and the report pages, print URL and login
	bash scripts/airflow.sh
