from .start import main

if __name__ == "__main__":  # not when a spawned worker imports the main module as __mp_main__
    raise SystemExit(main())
