"""GefenMuon: its registry entry (``entry``), options table (``options``) and state adapter
(``sharded``). Its sharded step is ``optim.muon``; its records are ``checkpoint.format.gefen_muon_records``."""
