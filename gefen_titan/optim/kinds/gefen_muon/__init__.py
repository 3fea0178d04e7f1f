"""GefenMuon: its registry entry (``entry``), options table (``options``), its rows of the checkpoint format
(``keys``), its records (``records``), its checkpoint description (``description``), what its state costs
(``cost``) and its state adapter (``sharded``). Its sharded step is ``optim.muon``."""
