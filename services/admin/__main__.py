from splitstream.admin.main import main

raise SystemExit(main())
