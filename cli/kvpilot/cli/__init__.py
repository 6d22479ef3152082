"""The `kvpilot` command: a composition root that imports each subcommand lazily."""
