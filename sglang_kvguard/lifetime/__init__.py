"""Page lifetime machinery shared by the page guards, below them: page pins and holds
(``page_hold``), the drain protocol between the nodes (``transfer_drain``), peer
liveness (``peer_liveness``), kvguard's own ZMQ sockets (``push_sockets``), and the one
description of what a PD transfer moves (``transfer_components``). Knows no guard."""
