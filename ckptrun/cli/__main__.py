"""``python -m ckptrun.cli ...`` is the same as the ``ckptrun`` command."""

from ckptrun.cli import main

if __name__ == "__main__":
    main()
