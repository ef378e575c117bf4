"""`python -m rolectl`: the same command line as the `rolectl` script."""

from rolectl.roles.cli import main

main()
