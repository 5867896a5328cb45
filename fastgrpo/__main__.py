import sys

from fastgrpo.cli import main

sys.exit(main())
