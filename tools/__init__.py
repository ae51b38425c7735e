"""Developer and test tools, imported by tests/ and bench/ only, never by the application."""
