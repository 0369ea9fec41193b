import sys

from jaxcb.cli import main

sys.exit(main())
