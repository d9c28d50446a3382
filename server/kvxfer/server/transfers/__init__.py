"""Transfers: the registrations and state machine behind expect/push/offer/pull.

Every transfer is keyed by its id (the engine's request id) and has a role on
this daemon, a deadline, and a final state (done, failed, aborted, deadline
exceeded) that both sides learn.

Push (``expect`` on the decode daemon D first, whose answer holds the capability
that ``push`` on the prefill daemon P presents):

1. P opens a session with D (``kvxfer.server.sessions``): the handshake tells
   D every pool P serves, so a ``Claim`` names its source pool.
2. P claims the transfer with the capability. D finds the matching ``expect``
   (NOT_FOUND at once without it, ``capability``), checks the layouts, plans
   the chunks, posts one receive per chunk straight into the destination pages
   and answers with the tag base (``receiver``).
3. P plans the same chunks and sends them from the source pages, a bounded
   window in flight (``sender``). Without verify, each side is done when its
   messages complete.
4. With verify, P calls ``Commit`` with per-chunk checksums; D checks the
   bytes that arrived and answers with the final status, which P adopts.

Pull is the same with one step before: ``pull`` on D registers the expectation
and asks P (``RequestPush``) to push once its ``offer`` is there. When P holds a
session it opened to D, the ask places the pages (where they go, the tag base,
the lanes): P skips steps 1 and 2, sends at once and answers with its runs, and
D posts the receives then, so a pull costs one round trip. While D's engine still
wants an offer it has not pulled yet (its request waits in the engine's queue), D keeps
it waiting at P (``KeepOffers``), and drops it when the engine never will
(``offer_keeping``).

Modules: ``record`` (one side of a transfer and the table of its states), ``early_aborts``
(aborts that came before their transfer),
``registry`` (registration, lookup for peers, retention, endings), ``planning``
(chunks and tags), ``sender``, ``receiver``, ``offer_keeping``, and ``coordinator``
(the verbs).
"""
