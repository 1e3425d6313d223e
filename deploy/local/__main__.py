import sys

from deploy.local.stack import main

sys.exit(main())
