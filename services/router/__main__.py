from splitstream.router.main import main

raise SystemExit(main())
