import sys

from smoltrain.cli import main

sys.exit(main())
