from fleet_gateway.main import cli

cli()
