import sys

from spork_trt.cli.main import main

sys.exit(main())
