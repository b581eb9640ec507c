import sys

from jaxlearn.cli.main import main

sys.exit(main())
