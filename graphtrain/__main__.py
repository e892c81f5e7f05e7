import sys

from graphtrain.cli import main

sys.exit(main())
