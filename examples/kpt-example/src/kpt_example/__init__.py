"""An example kpt backend package: see README.md."""
