"""python -m thunder_tp.checkpoint export DIR OUT"""

import sys

from thunder_tp.checkpoint.exporting import main

sys.exit(main(sys.argv[1:]))
