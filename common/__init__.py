"""What every package shares, and nothing of the project: the user-error type
(``common.errors.UserError``), the config framework (``common.config``: typed dataclass fields read
from YAML and ``section.field=value``), and files published whole (``common.files``).

Imports: the standard library, numpy and PyYAML, nothing of the project; every other package
may import this one.
"""
