from hfexport.cli import main

raise SystemExit(main())
