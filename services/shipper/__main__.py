from splitstream.shipper.main import main

raise SystemExit(main())
