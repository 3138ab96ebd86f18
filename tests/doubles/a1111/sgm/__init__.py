"""Double of the sgm package. The real ``__init__`` pulls in pytorch_lightning and more; this one is bare."""
