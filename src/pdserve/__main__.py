import sys

from pdserve.cluster.cli import main

sys.exit(main())
