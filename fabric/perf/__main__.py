import sys

from fabric.perf.cli import main

sys.exit(main())
