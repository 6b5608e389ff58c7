import sys

from kdsl.cli import main

sys.exit(main())
