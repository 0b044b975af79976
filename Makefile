.PHONY: demo test lint airflow
demo:  ## set up and run the whole DAG on the emulated fleet
	bash scripts/demo.sh
test:  ## set up and run the tests and the lint
	bash scripts/test.sh
lint:
	.venv/bin/ruff check .
airflow:  ## start a local Airflow with the DAG and the report pages, print URL and login
	bash scripts/airflow.sh
