import sys

from kvpilot.cli.main import main

sys.exit(main())
