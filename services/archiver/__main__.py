from splitstream.archiver.main import main

raise SystemExit(main())
