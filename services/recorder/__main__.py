from splitstream.recorder.main import main

raise SystemExit(main())
