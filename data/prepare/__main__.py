"""``python -m data.prepare``: text -> MLPerf BERT pretraining shards (``data.prepare.shards``)."""

from common.errors import cli_main
from data.prepare.shards import main

raise SystemExit(cli_main(main))
