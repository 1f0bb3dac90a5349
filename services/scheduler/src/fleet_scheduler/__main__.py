from fleet_scheduler.main import cli

cli()
