"""The `pt2flow` command line (docs/architecture.md §4): `main` parses and dispatches, `support`
holds what every command shares, one module per group of commands."""
