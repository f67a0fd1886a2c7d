"""Renderers: what the replay, `explain` and `validate` return, drawn for a person (Rich) or written as data
(JSON, CSV, a Chrome trace). Every module here only reads results; nothing measures or decides.

Rules: one module per thing drawn (report.py: a replay's summary and files; compare.py; explain.py; validate.py;
html/: the pictures, an HTML report and the explain figures, imported only when asked for), all through
text.py's `safe`, `say` and `fit_table`, so that names are never markup, control characters are escaped,
messages are not wrapped when piped and key columns stay whole at 80 columns. Rich is imported when something is
drawn, not at load. Only kvmap.cli imports this package.
"""
