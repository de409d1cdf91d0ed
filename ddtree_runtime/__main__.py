import sys

from ddtree_runtime.cli import main

sys.exit(main())
