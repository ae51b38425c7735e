"""``python -m data.prepare``: text -> MLPerf BERT pretraining shards (``data.prepare.shards``)."""

from data.prepare.shards import main

raise SystemExit(main())
