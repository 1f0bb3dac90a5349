from fleet_downloader.main import cli

cli()
