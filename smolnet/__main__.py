import sys

from smolnet.cli import main

sys.exit(main())
