from fleet_metrics.main import cli

cli()
