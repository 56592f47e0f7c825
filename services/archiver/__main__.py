from splitstream.archiver.main import main

if __name__ == "__main__":  # not in a spawned builder process
    raise SystemExit(main())
