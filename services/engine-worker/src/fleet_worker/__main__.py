from fleet_worker.main import cli

cli()
