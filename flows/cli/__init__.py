"""The `pt2flow` command line (docs/architecture.md §4), on click: `main` holds the root group
(subcommands loaded lazily) and `main()`, `errors` the exit codes and the one handler that maps
exceptions to them, `support` what every command shares, then one module per group of commands
(run, serve, validate, queries, maintenance, report)."""
