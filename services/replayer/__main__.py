from splitstream.replayer.main import main

raise SystemExit(main())
