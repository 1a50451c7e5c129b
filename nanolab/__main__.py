import sys

from nanolab.cli import main

sys.exit(main())
