class CommCounter: pass
