import sys

from fleet_local.cli import main

sys.exit(main())
