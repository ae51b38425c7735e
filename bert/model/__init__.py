"""The encoder and its heads, assembled from a ``BertConfig`` (``config``): embeddings, layers
(``layers``), BERT for pretraining (``pretraining.BertForPreTraining``), FP8 linears (``fp8``), and one
transformers adapter per ``model_type`` (``hf_bert``, ``hf_modernbert``).

Imports: ``kernels``, ``data.batch`` (the batch types), ``bert.distributed.context_parallel`` (a CP
rank's batch) and ``common``; nothing else of ``bert``.
"""
