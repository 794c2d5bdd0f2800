/*
 * pd_transfer.pml: who owns which KV page in SGLang's prefill/decode (PD)
 * disaggregated serving over Mooncake, with kvguard's guards as compile-time switches.
 *
 * Checked by scripts/check-model.sh; explained in docs/design/formal-model.md.
 *
 * Every action is one d_step named after the real function it stands for.  A name
 * written with a leading at-sign in this file is a kvguard hook target: the qualname
 * of an entry of patches/sglang-0.5.19.json or patches/sglang-0.5.23.json with its
 * dots written as underscores (tests/unit/test_formal_model.py checks this).  The
 * printf lines are what a counterexample trail shows.
 *
 * Switches (spin -D...):
 *   release family, exactly one: REL_0519 | REL_0523
 *   guards: ADMISSION_DRAIN REJECTION_NOTICE COVERAGE SOURCE_HOLD DEST_HOLD QUARANTINE
 *           GENERATION CHECKSUM CANARY POOL_CHECK FLUSH_BARRIER PEER_LIVENESS
 *           (PEER_LIVENESS is read only with PEER_CAN_DIE)
 *   properties (safety): PROP_ISOLATION PROP_FID200 PROP_FID4XX PROP_REUSE_SRC
 *           PROP_REUSE_DST PROP_LATEWRITE PROP_CONSERVATION PROP_UAF PROP_TERMINAL
 *   property (LTL, pan -a -f): PROGRESS
 *   environment: PEER_NEVER_RESUMES (a failed batch never lands; default: it may land
 *           at any later time, and does eventually); NO_CLIENT_ABORT (clients wait);
 *           ANY_FIT (request 1 may also be a prompt that fits: extended check, not in CI);
 *           PEER_CAN_DIE (the peer of a failed batch may vanish: the batch never lands);
 *           ROUTER_RETRY (the router retries a request answered 500 once, as room 3: a new
 *           bootstrap room carrying the same prompt; room 3 is then only that retry)
 *   non-vacuity probes: REACH_TWO_200 REACH_NOTICE_400 REACH_LATE_INTO_HELD
 *           REACH_SOURCE_HELD REACH_FLUSH REACH_QUARANTINE REACH_RETRY_200 (with
 *           ROUTER_RETRY) REACH_DEAD_RELEASE (with PEER_CAN_DIE) (each must be reachable)
 *   bounds: NREQ = 2 or 3 (default 3), NPAGE = 3..7 pages per node (default 6);
 *           two chunks (one page each) per request.
 *
 * Request 1 is the prompt that prefill's scheduler rejects (over the prefill pool; with
 * POOL_CHECK: over the context, or in prefill_admission_fit's band); requests 2..NREQ
 * fit.  Page content = whose KV was last written there, and for which position:
 * KV(r,c) = 2r+c is request r's KV for its page c; 8+r is request r's destination
 * canary; 0 is anything that is not the current owner's (pages are never zeroed).
 */

#ifndef NREQ
#define NREQ 3
#endif
#ifndef NPAGE
#define NPAGE 6
#endif

#if defined(REL_0519) && defined(REL_0523)
#error "pick one release family"
#endif
#if !defined(REL_0519) && !defined(REL_0523)
#error "pick a release family: -DREL_0519 or -DREL_0523"
#endif

/* kvguard's decode_destination_hold (0.5.10-0.5.20) switches itself off when
 * prefill_source_hold is disabled: that guard counts each room's queued and in-flight
 * chunks, which is what prefill's drain answer reports (guards/decode_destination_hold.py) */
#if defined(REL_0519) && defined(DEST_HOLD) && !defined(SOURCE_HOLD)
#undef DEST_HOLD
#endif

#define NOPAGE 255
#define KV(r,c)     (2*(r)+(c))
/* whose prompt room r carries: its own, or (ROUTER_RETRY) the retried request's */
#ifdef ROUTER_RETRY
#define PROMPT(r)   (((r) == 3 && retry_of != 0) -> retry_of : (r))
#else
#define PROMPT(r)   (r)
#endif
#define KVP(r,c)    KV(PROMPT(r), c)   /* the KV room r's forward writes: same prompt, same KV */
#define CANVAL(r)   (8+(r))

/* transfer chunk (one page) */
#define C_FUTURE   0   /* not handed to the transfer engine (yet) */
#define C_INFLIGHT 1   /* batch running: it will read its source page and write its destination */
#define C_TIMEDOUT 2   /* the worker saw the batch fail (timeout) and moved on; the batch still runs */
#define C_DONE     3   /* landed, or never sent: touches no page any more */
#define C_DEAD     4   /* (PEER_CAN_DIE) its peer vanished: it never lands; only a liveness probe can tell */

/* prefill phase */
#define P_NONE   0
#define P_QUEUED 1     /* PrefillBootstrapQueue: waiting for decode's metadata */
#define P_SENT1  2     /* first chunk handed over, second not yet */
#define P_SENT   3     /* last chunk handed over: inflight queue */
#define P_DONE   4

/* decode phase */
#define D_NONE     0
#define D_QUEUED   1   /* DecodePreallocQueue */
#define D_RESERVED 2   /* pages reserved, metadata sent: DecodeTransferQueue */
#define D_RUNNING  3   /* committed: running batch */
#define D_DONE     4

/* room (bootstrap room) status as both sides see it */
#define R_LIVE    0
#define R_SUCCESS 1
#define R_FAILED  2

/* answers (printed; the state keeps only "answered") */
#define A_200  1
#define A_400  2       /* the rejection's own status and message */
#define A_500  3
#define A_GONE 4       /* the client disconnected or aborted */

/* a claim on pages: per request on decode, per chunk page on prefill */
#define L_NONE 0
#define L_LIVE 1       /* owned by the request */
#define L_HELD 2       /* given back by the owner, held out of the free list until the transfer drains */
#define L_QUAR 3       /* held past the bound: quarantined, never freed blind */

/* ---------------------------------------------------------------- state */
byte dfree[NPAGE] = 1;        /* decode allocator: copies of page p in its free list (2 = freed twice) */
byte dcont[NPAGE] = 0;        /* decode page content */
byte pfree[NPAGE] = 1;        /* prefill allocator */
byte pcont[NPAGE] = 0;        /* prefill page content */

bit  answered[NREQ+1];        /* the client got its answer (or left) */
byte pst[NREQ+1];             /* prefill phase */
byte dst[NREQ+1];             /* decode phase */
byte rs[NREQ+1];              /* room status */
byte dl[NREQ+1];              /* decode claim on dpg[2r], dpg[2r+1] */
byte stale[NREQ+1];           /* page_generation: bit c = dpg[2r+c] was freed behind r's back */
bit  notice[NREQ+1];          /* rejection_notice: decode holds prefill's original 400 */
bit  stub[NREQ+1];            /* prefill runs the one-token stub of a rejected prompt */
byte dpg[2*(NREQ+1)] = NOPAGE;   /* decode page written by chunk c of r (from send_metadata) */
byte ppg[2*(NREQ+1)] = NOPAGE;   /* prefill page read by chunk c of r */
byte pls[2*(NREQ+1)];            /* prefill claim on ppg[2r+c] */
byte ch[2*(NREQ+1)];             /* transfer chunk state */
bit  flushed_d, flushed_p;    /* each scheduler gets one /flush_cache at most */
bit  rejected1;               /* request 1 is the prompt prefill rejects (else it fits) */
#ifdef ROUTER_RETRY
byte retry_of;                /* room 3 is the router's retry of this request (0: no retry yet) */
#if NREQ != 3
#error "ROUTER_RETRY needs NREQ 3 (room 3 is the retry)"
#endif
#endif

byte q, pa, pb, bad;          /* scratch inside a step; always 0 between steps
                                 (not "hidden": BFS cannot use hidden variables) */
#ifdef REACH_TWO_200
byte n200;
#endif

/* ---------------------------------------------------------------- expressions */
#if NREQ == 3
#define FORALL(X) (X(1) && X(2) && X(3))
#define EXISTS(X) (X(1) || X(2) || X(3))
#define SUM(X) (X(1) + X(2) + X(3))
#elif NREQ == 2
#define FORALL(X) (X(1) && X(2))
#define EXISTS(X) (X(1) || X(2))
#define SUM(X) (X(1) + X(2))
#else
#error "NREQ must be 2 or 3"
#endif

#define CH(r,c)      ch[2*(r)+(c)]
#define BUSY(r,c)    (CH(r,c) == C_INFLIGHT || CH(r,c) == C_TIMEDOUT)
#define INFL(r)      (CH(r,0) == C_INFLIGHT || CH(r,1) == C_INFLIGHT)
#define TOUT(r)      (CH(r,0) == C_TIMEDOUT || CH(r,1) == C_TIMEDOUT)
/* what the holds can tell: a batch whose peer died looks unsettled for ever, unless
 * peer_liveness confirms the peer gone (its session port refuses connections) */
#if defined(PEER_CAN_DIE) && !defined(PEER_LIVENESS)
#define KBUSY(r,c)   (BUSY(r,c) || CH(r,c) == C_DEAD)
#else
#define KBUSY(r,c)   BUSY(r,c)
#endif
#define HOLDING(x)   ((x) == L_HELD || (x) == L_QUAR)
#define CLAIMS(x)    ((x) != L_NONE)

#define P_ACTIVE(r)  (pst[r] == P_QUEUED || pst[r] == P_SENT1 || pst[r] == P_SENT)
#define D_ACTIVE(r)  (dst[r] == D_QUEUED || dst[r] == D_RESERVED || dst[r] == D_RUNNING)
#define P_HOLDS(r)   (HOLDING(pls[2*(r)]) || HOLDING(pls[2*(r)+1]))
#define D_HOLDS(r)   (HOLDING(dl[r]))

/* When may decode give back the pages of a failed room (the drain signal it trusts)?
 * 0.5.23: upstream's ABORT_ACK, sent once _staging_outstanding == 0 and withheld for a
 * failed send that may still run (_poison_unsettled_send, deferred release on).
 * 0.5.19 with decode_destination_hold: kvguard's KVGUARD_DRAINED/1 (transfer_drain),
 * sent when no chunk is queued or in flight and withheld while a failed send of the room
 * is unsettled (prefill_source_hold).  Either way: no chunk may still write. */
#define D_DRAINED(r) (!KBUSY(r,0) && !KBUSY(r,1))

/* decode page p will still be written by chunk (r,c) */
#define DBUSY1(r,c,p) (dpg[2*(r)+(c)] == (p) && (BUSY(r,c) || (CH(r,c) == C_FUTURE && rs[r] == R_LIVE)))
/* prefill page p will still be read by chunk (r,c) */
#define PBUSY1(r,c,p) (ppg[2*(r)+(c)] == (p) && BUSY(r,c))

/* decode page p is in a live reservation; prefill page p is read by a running batch */
#define D_OWNED1(r,p) (dl[r] == L_LIVE && (dpg[2*(r)] == (p) || dpg[2*(r)+1] == (p)))
#define P_READ1(r,p)  (PBUSY1(r,0,p) || PBUSY1(r,1,p))
#define D_BUSY1(r,p)  (DBUSY1(r,0,p) || DBUSY1(r,1,p))
#if NREQ == 3
#define D_OWNED(p) (D_OWNED1(1,p) || D_OWNED1(2,p) || D_OWNED1(3,p))
#define P_READ(p)  (P_READ1(1,p) || P_READ1(2,p) || P_READ1(3,p))
#define D_BUSY(p)  (D_BUSY1(1,p) || D_BUSY1(2,p) || D_BUSY1(3,p))
#else
#define D_OWNED(p) (D_OWNED1(1,p) || D_OWNED1(2,p))
#define P_READ(p)  (P_READ1(1,p) || P_READ1(2,p))
#define D_BUSY(p)  (D_BUSY1(1,p) || D_BUSY1(2,p))
#endif

/* page p of a pool: free-list copies + claims that list it (conservation: always 1) */
#define DCL(r,p) ((CLAIMS(dl[r]) && dpg[2*(r)] == (p)) + (CLAIMS(dl[r]) && dpg[2*(r)+1] == (p)))
#define PCL(r,p) ((CLAIMS(pls[2*(r)]) && ppg[2*(r)] == (p)) + (CLAIMS(pls[2*(r)+1]) && ppg[2*(r)+1] == (p)))
#if NREQ == 3
#define DCOUNT(p) (dfree[p] + DCL(1,p) + DCL(2,p) + DCL(3,p))
#define PCOUNT(p) (pfree[p] + PCL(1,p) + PCL(2,p) + PCL(3,p))
#else
#define DCOUNT(p) (dfree[p] + DCL(1,p) + DCL(2,p))
#define PCOUNT(p) (pfree[p] + PCL(1,p) + PCL(2,p))
#endif
#define CONS(p) (DCOUNT(p) == 1 && PCOUNT(p) == 1)

/* a free page nothing refers to is "clean": all clean pages of a pool are interchangeable,
 * so allocation takes the lowest clean page or any free page that is not clean */
#if NREQ == 3
#define DCLM(p) (DCL(1,p) + DCL(2,p) + DCL(3,p) > 0)
#define PCLM(p) (PCL(1,p) + PCL(2,p) + PCL(3,p) > 0)
#else
#define DCLM(p) (DCL(1,p) + DCL(2,p) > 0)
#define PCLM(p) (PCL(1,p) + PCL(2,p) > 0)
#endif
#define PCLEAN(p) (pfree[p] == 1 && !PCLM(p) && !P_READ(p))
#define PDIRTY(p) (pfree[p] > 0 && !PCLEAN(p))
#define DCLEAN(p) (dfree[p] == 1 && !DCLM(p) && !D_BUSY(p))
#define DDIRTY(p) (dfree[p] > 0 && !DCLEAN(p))
#define DDIRTY2(p) (DDIRTY(p) && (p) != pa)

#define PF(i) (pfree[i] > 0)
#define DF(i) (dfree[i] > 0)
#if NPAGE == 3
#define P_FREE_PAGE (PF(0) || PF(1) || PF(2))
#define D_TWO_FREE  (DF(0) + DF(1) + DF(2) >= 2)
#define CONSERVED   (CONS(0) && CONS(1) && CONS(2))
#define PICK(D, v)  :: D(0) -> v = 0 :: D(1) -> v = 1 :: D(2) -> v = 2
#elif NPAGE == 4
#define P_FREE_PAGE (PF(0) || PF(1) || PF(2) || PF(3))
#define D_TWO_FREE  (DF(0) + DF(1) + DF(2) + DF(3) >= 2)
#define CONSERVED   (CONS(0) && CONS(1) && CONS(2) && CONS(3))
#define PICK(D, v)  :: D(0) -> v = 0 :: D(1) -> v = 1 :: D(2) -> v = 2 :: D(3) -> v = 3
#elif NPAGE == 5
#define P_FREE_PAGE (PF(0) || PF(1) || PF(2) || PF(3) || PF(4))
#define D_TWO_FREE  (DF(0) + DF(1) + DF(2) + DF(3) + DF(4) >= 2)
#define CONSERVED   (CONS(0) && CONS(1) && CONS(2) && CONS(3) && CONS(4))
#define PICK(D, v)  :: D(0) -> v = 0 :: D(1) -> v = 1 :: D(2) -> v = 2 :: D(3) -> v = 3 :: D(4) -> v = 4
#elif NPAGE == 6
#define P_FREE_PAGE (PF(0) || PF(1) || PF(2) || PF(3) || PF(4) || PF(5))
#define D_TWO_FREE  (DF(0) + DF(1) + DF(2) + DF(3) + DF(4) + DF(5) >= 2)
#define CONSERVED   (CONS(0) && CONS(1) && CONS(2) && CONS(3) && CONS(4) && CONS(5))
#define PICK(D, v)  :: D(0) -> v = 0 :: D(1) -> v = 1 :: D(2) -> v = 2 :: D(3) -> v = 3 :: D(4) -> v = 4 :: D(5) -> v = 5
#elif NPAGE == 7
#define P_FREE_PAGE (PF(0) || PF(1) || PF(2) || PF(3) || PF(4) || PF(5) || PF(6))
#define D_TWO_FREE  (DF(0) + DF(1) + DF(2) + DF(3) + DF(4) + DF(5) + DF(6) >= 2)
#define CONSERVED   (CONS(0) && CONS(1) && CONS(2) && CONS(3) && CONS(4) && CONS(5) && CONS(6))
#define PICK(D, v)  :: D(0) -> v = 0 :: D(1) -> v = 1 :: D(2) -> v = 2 :: D(3) -> v = 3 :: D(4) -> v = 4 :: D(5) -> v = 5 :: D(6) -> v = 6
#else
#error "NPAGE must be 3..7"
#endif

/* every request ended and no page is owned or held (free or quarantined only) */
#ifdef ROUTER_RETRY
#define ROOM_ANSWERED(r) (answered[r] || ((r) == 3 && retry_of == 0))   /* room 3 not needed */
#else
#define ROOM_ANSWERED(r) (answered[r])
#endif
#define ENDED(r) (ROOM_ANSWERED(r) && !P_ACTIVE(r) && !D_ACTIVE(r) && dl[r] != L_LIVE && dl[r] != L_HELD && pls[2*(r)] != L_LIVE && pls[2*(r)] != L_HELD && pls[2*(r)+1] != L_LIVE && pls[2*(r)+1] != L_HELD)
#define ALLDONE FORALL(ENDED)

/* Held pages are given back in the same step as the drain that allows it, except
 * where a /flush_cache could land between the two (formal-model.md, exact reductions). */
#ifdef FLUSH_BARRIER
#define MERGE_PSETTLE
#define MERGE_DSETTLE
#elif defined(REL_0523)
#define MERGE_DSETTLE
#endif

/* ================================================================ page pools */

inline show_dpage(p) {         /* prints what decode page p holds */
  if
  :: dcont[p] == 0 -> printf("     decode page %d holds KV that is not its owner's\n", p)
  :: dcont[p] >= 8 -> printf("     decode page %d holds r%d's canary (never written)\n", p, dcont[p] - 8)
  :: else          -> printf("     decode page %d holds r%d's KV for its page %d\n", p, dcont[p] / 2, dcont[p] % 2)
  fi
}

inline show_ppage(p) {         /* prints what prefill page p holds */
  if
  :: pcont[p] == 0 -> printf("     prefill page %d holds KV that is not this request's\n", p)
  :: else          -> printf("     prefill page %d holds r%d's KV for its page %d\n", p, pcont[p] / 2, pcont[p] % 2)
  fi
}

/* @PagedTokenToKVPoolAllocator_free on decode: the page goes back to the free list and
 * gets a new generation, so a request that still lists it sees it stale. */
inline d_free(p) {
  dfree[p] = dfree[p] + 1;
  for (q : 1 .. NREQ) {
    if :: dl[q] == L_LIVE && dpg[2*q] == p   -> stale[q] = stale[q] | 1 :: else fi;
    if :: dl[q] == L_LIVE && dpg[2*q+1] == p -> stale[q] = stale[q] | 2 :: else fi
  };
  q = 0;
  if :: !D_OWNED(p) -> dcont[p] = 0 :: else fi      /* dead value: nobody can read it */
}

inline d_release(r) {          /* free both pages of r's reservation */
  dl[r] = L_NONE; stale[r] = 0;
  d_free(dpg[2*r]);
  d_free(dpg[2*r+1])
}

inline p_free(p) {             /* @PagedTokenToKVPoolAllocator_free on prefill */
  pfree[p] = pfree[p] + 1;
  if :: !P_READ(p) -> pcont[p] = 0 :: else fi       /* dead value */
}

/* Dead values: page ids nobody can use any more are forgotten, and a request that ended
 * and touches nothing any more forgets everything. */
#define RETIRABLE(r) (answered[r] && !P_ACTIVE(r) && !D_ACTIVE(r) && !BUSY(r,0) && !BUSY(r,1) && dl[r] == L_NONE && pls[2*(r)] == L_NONE && pls[2*(r)+1] == L_NONE)
inline retire(r) {
  if :: pls[2*r]   == L_NONE && !BUSY(r,0) -> ppg[2*r]   = NOPAGE :: else fi;
  if :: pls[2*r+1] == L_NONE && !BUSY(r,1) -> ppg[2*r+1] = NOPAGE :: else fi;
  if
  :: dl[r] == L_NONE && !BUSY(r,0) && !BUSY(r,1) && rs[r] != R_LIVE ->
     dpg[2*r] = NOPAGE; dpg[2*r+1] = NOPAGE
  :: else
  fi;
  if
  :: RETIRABLE(r) ->
     pst[r] = P_DONE; dst[r] = D_DONE; rs[r] = R_FAILED; notice[r] = 0; stub[r] = 0;
#ifndef ROUTER_RETRY
     if :: r == 1 -> rejected1 = 0 :: else fi;     /* (kept for a retry of r1 with ROUTER_RETRY) */
#endif
     CH(r,0) = C_DONE; CH(r,1) = C_DONE
  :: else
  fi
}

/* ---------------------------------------------------------------- prefill source pages */

/* prefill gives back the page of chunk (r,c) */
inline p_release_chunk(r, c) {
  if
  :: pls[2*r+c] == L_LIVE ->
#ifdef SOURCE_HOLD
     if
     :: BUSY(r,c) ->
        pls[2*r+c] = L_HELD;
        printf("  @PagedTokenToKVPoolAllocator__release_page_ids: prefill page %d of r%d held, chunk %d still reads it (prefill_source_hold)\n", ppg[2*r+c], r, c);
#ifdef REACH_SOURCE_HELD
        assert(false);
#endif
        skip
     :: else -> pls[2*r+c] = L_NONE; p_free(ppg[2*r+c])
     fi
#else
     if
     :: BUSY(r,c) -> printf("  @PagedTokenToKVPoolAllocator_free: prefill page %d of r%d freed while chunk %d still reads it\n", ppg[2*r+c], r, c)
     :: else
     fi;
     pls[2*r+c] = L_NONE; p_free(ppg[2*r+c])
#endif
  :: else
  fi
}

/* ---------------------------------------------------------------- decode destination pages */

inline d_hold(r) {
  dl[r] = L_HELD;
#if defined(REL_0523)
  printf("  @DecodeTransferQueue__defer_release: pages %d,%d of r%d held until prefill's ABORT_ACK\n", dpg[2*r], dpg[2*r+1], r)
#else
  printf("  pins from @MooncakeKVReceiver_send_metadata kept: pages %d,%d of r%d held until every prefill rank drained (decode_destination_hold)\n", dpg[2*r], dpg[2*r+1], r)
#endif
}

/* decode gives back the pages of a room that failed while its transfer may still run */
inline d_fail_release(r) {
#if defined(REL_0523) || defined(DEST_HOLD)
#ifdef MERGE_DSETTLE
  if
  :: D_DRAINED(r) ->
     printf("  @PagedTokenToKVPoolAllocator_free: decode pages %d,%d of r%d (room already drained)\n", dpg[2*r], dpg[2*r+1], r);
     d_release(r)
  :: else -> d_hold(r)
  fi
#else
  d_hold(r)
#endif
#else
  printf("  @PagedTokenToKVPoolAllocator_free: decode pages %d,%d of r%d freed at once\n", dpg[2*r], dpg[2*r+1], r);
  d_release(r)
#endif
}

/* ================================================================ answers, failures */
/* room r carries the prompt prefill rejects */
#define REJECTED(r) (PROMPT(r) == 1 && rejected1)

inline answer(r, code) {
  answered[r] = 1;
#ifdef ROUTER_RETRY
  if
  :: code == A_500 && r != 3 && retry_of == 0 ->
     /* the router retries a 500 (sglang-router's default): a new room, the same prompt;
      * the client waits on the retry, the 500 never reaches it */
     retry_of = r;
     printf("  => r%d's 500 goes to the router, which retries the request as room 3\n", r)
  :: else ->
#endif
  if
  :: code == A_200  -> printf("  => client r%d gets HTTP 200\n", PROMPT(r))
  :: code == A_400  -> printf("  => client r%d gets HTTP 400 with the rejection's own message\n", PROMPT(r))
  :: code == A_500  -> printf("  => client r%d gets HTTP 500\n", PROMPT(r))
  :: code == A_GONE -> printf("  => client r%d gone (no answer)\n", PROMPT(r))
  fi;
#ifdef PROP_FID200
  assert(!(REJECTED(r) && code == A_200));                        /* error fidelity: never 200 */
#endif
#ifdef PROP_FID4XX
  assert(!(REJECTED(r) && code != A_400 && code != A_GONE));      /* error fidelity: its own 400 */
#endif
#ifdef ROUTER_RETRY
  skip
  fi;
#endif
#ifdef REACH_NOTICE_400
  assert(!(r == 1 && code == A_400 && notice[1]));
#endif
#ifdef REACH_TWO_200
  if :: code == A_200 -> n200++; assert(n200 < 2) :: else fi;
#endif
#if defined(REACH_RETRY_200) && defined(ROUTER_RETRY)
  assert(!(r == 3 && retry_of != 0 && code == A_200));   /* a retried request is served */
#endif
  skip
}

/* The room fails (abort, timeout, prefill's Failed, a rejection notice).  Both sides
 * react in this step: prefill stops sending and gives back its pages, decode answers
 * and gives back (or holds) its pages. */
inline fail_room(r) {
  rs[r] = R_FAILED;
  if :: CH(r,0) == C_FUTURE -> CH(r,0) = C_DONE :: else fi;
  if :: CH(r,1) == C_FUTURE -> CH(r,1) = C_DONE :: else fi;
  if
  :: P_ACTIVE(r) ->
     p_release_chunk(r, 0); p_release_chunk(r, 1); pst[r] = P_DONE
  :: else
  fi;
  if
  :: dst[r] == D_QUEUED || dst[r] == D_RESERVED ->
     if
     :: !answered[r] && notice[r] ->
        printf("  decode @prepare_abort r%d with prefill's original message and 400 (rejection_notice, read by @MooncakeKVManager__handle_aux_data)\n", r);
        answer(r, A_400)
     :: !answered[r] && !notice[r] ->
        printf("  decode @DecodeTransferQueue_pop_transferred polls Failed -> @prepare_abort r%d: 500\n", r);
        answer(r, A_500)
     :: else
     fi;
     if :: dst[r] == D_RESERVED -> d_fail_release(r) :: else fi;
     dst[r] = D_DONE
  :: else
  fi
}

/* ================================================================ clients and router */

#define FRESH(r) (!answered[r] && pst[r] == P_NONE && dst[r] == D_NONE)
#ifdef ROUTER_RETRY
/* room 3 is only the router's retry */
#define FORWARD_OK(r) (FRESH(r) && ((r) < 3 || retry_of != 0))
#else
/* requests 2..NREQ are identical: the first of them is forwarded first (symmetry) */
#define FORWARD_OK(r) (FRESH(r) && ((r) < 3 || !FRESH(2)))
#endif

proctype Client_router(byte r)
{
end:
  do
  :: d_step { FORWARD_OK(r) ->
       if
       :: PROMPT(r) != r -> printf("r%d: router forwards r%d's prompt again to prefill and decode (retry; @TokenizerManager__send_one_request)\n", r, PROMPT(r))
       :: else -> printf("r%d: router forwards to prefill and decode (@TokenizerManager__send_one_request)\n", r)
       fi;
       dst[r] = D_QUEUED;
       printf("  decode @DecodePreallocQueue_add r%d (full prompt: 2 pages)\n", r);
       if
       :: PROMPT(r) == 1 ->
          rejected1 = 1;
#if defined(REL_0523)
          printf("  prefill @validate_input_length rejects r%d (400); @is_unadmitted_reject -> @Scheduler_retire_unadmitted_request at @PrefillBootstrapQueue_add\n", r);
          pst[r] = P_DONE;
#if defined(REJECTION_NOTICE)
          printf("  rejection_notice: notice to decode + @CommonKVManager_update_status(Failed)\n");
          notice[r] = 1; fail_room(r);
#endif
#elif defined(ADMISSION_DRAIN)
          printf("  prefill @validate_input_length rejects r%d (400); admission_drain withdraws it at @PrefillBootstrapQueue_add\n", r);
          pst[r] = P_DONE;
#if defined(REJECTION_NOTICE)
          printf("  rejection_notice: notice to decode + @CommonKVManager_update_status(Failed)\n");
          notice[r] = 1; fail_room(r);
#endif
#else
          printf("  prefill @validate_input_length rejects r%d: one-token stub, to_finish=400; @PrefillBootstrapQueue_add finds it alive\n", r);
          stub[r] = 1; pst[r] = P_QUEUED;
#endif
          skip
       :: else -> pst[r] = P_QUEUED
       fi;
       retire(r) }
#ifdef ANY_FIT
  /* extended check (not in CI: 43M states): request 1 may also be an ordinary prompt
   * that fits, so that three requests transfer at once even with every guard on */
  :: d_step { r == 1 && FRESH(1) ->
       printf("r1: router forwards to prefill and decode (@TokenizerManager__send_one_request); r1 fits\n");
       dst[r] = D_QUEUED; pst[r] = P_QUEUED }
#endif
#ifdef POOL_CHECK
  /* pool_capacity_check: the pool holds the context, so the over-capacity prompt is over
   * the context and gets 400 at the front door.  (A prompt in prefill_admission_fit's
   * band still takes the scheduler path above.) */
  :: d_step { PROMPT(r) == 1 && FORWARD_OK(r) ->
       printf("r%d: @TokenizerManager__validate_one_request: prompt over the context -> 400 at the front door\n", r);
       rejected1 = 1; answer(r, A_400); retire(r) }
#endif
#ifndef NO_CLIENT_ABORT
  /* the client disconnects or aborts at any step: both schedulers abort the request */
  :: d_step { !answered[r] && (pst[r] != P_NONE || dst[r] != D_NONE) ->
       printf("r%d: client disconnects -> @TokenizerManager_abort_request on both nodes\n", r);
       answer(r, A_GONE);
       if
       :: rs[r] == R_LIVE -> fail_room(r)
       :: else
       fi;
       if
       :: dst[r] == D_RESERVED || dst[r] == D_RUNNING ->   /* transfer complete */
          printf("  @PagedTokenToKVPoolAllocator_free: decode pages %d,%d of r%d\n", dpg[2*r], dpg[2*r+1], r);
          d_release(r); dst[r] = D_DONE
       :: else
       fi;
       retire(r) }
#endif
  od
}

/* ================================================================ prefill scheduler */

/* which page @PagedTokenToKVPoolAllocator_alloc hands out: the lowest clean page, or any
 * free page that is not clean (see "exact reductions" in formal-model.md) */
inline p_pick() {
  d_step {
    pa = NOPAGE;
    for (q : 0 .. NPAGE-1) { if :: pa == NOPAGE && PCLEAN(q) -> pa = q :: else fi };
    q = 0
  };
  if
  :: pa != NOPAGE
  PICK(PDIRTY, pa)
  fi
}

/* @PagedTokenToKVPoolAllocator_alloc page pa, forward, send */
inline p_alloc_send(r, c) {
  printf("  @PagedTokenToKVPoolAllocator_alloc prefill page %d, forward writes r%d's KV; @MooncakeKVManager_add_transfer_request chunk %d -> decode page %d\n", pa, r, c, dpg[2*r+c]);
#ifdef PROP_REUSE_SRC
  assert(!P_READ(pa));          /* no reuse under a transfer (prefill page) */
#endif
  pfree[pa] = pfree[pa] - 1;
  ppg[2*r+c] = pa; pls[2*r+c] = L_LIVE;
  pcont[pa] = KVP(r, c);        /* the forward writes r's KV for this position */
  CH(r,c) = C_INFLIGHT;         /* queued to the worker, which may start it at any time */
  pa = 0
}

proctype Prefill_scheduler(byte r)
{
end:
  do
  :: atomic { pst[r] == P_QUEUED && rs[r] == R_LIVE && dpg[2*r] != NOPAGE && P_FREE_PAGE ->
       p_pick();
       d_step {
         printf("r%d: prefill @PrefillBootstrapQueue_pop_bootstrapped; @SchedulerDisaggregationPrefillMixin_send_kv_chunk chunk 0\n", r);
         p_alloc_send(r, 0);
         if
         :: stub[r] ->
            CH(r,1) = C_DONE; pst[r] = P_SENT;
            printf("  stub: one token, one page, last chunk; @MetadataBuffers_set_buf publishes 1 page sent\n")
         :: else -> pst[r] = P_SENT1
         fi } }
  :: atomic { pst[r] == P_SENT1 && rs[r] == R_LIVE && P_FREE_PAGE ->
       p_pick();
       d_step {
         printf("r%d: prefill @SchedulerDisaggregationPrefillMixin_send_kv_chunk chunk 1 (last); @MetadataBuffers_set_buf publishes 2 pages sent\n", r);
         p_alloc_send(r, 1); pst[r] = P_SENT } }
#if defined(SOURCE_HOLD) && !defined(MERGE_PSETTLE)
  /* held pages go back once their chunk drained (kvguard: on the scheduler thread) */
  :: d_step { HOLDING(pls[2*r]) && !KBUSY(r,0) ->
       printf("r%d: prefill @PrefillBootstrapQueue_pop_bootstrapped gives back held page %d\n", r, ppg[2*r]);
       pls[2*r] = L_NONE; p_free(ppg[2*r]); retire(r) }
  :: d_step { HOLDING(pls[2*r+1]) && !KBUSY(r,1) ->
       printf("r%d: prefill @PrefillBootstrapQueue_pop_bootstrapped gives back held page %d\n", r, ppg[2*r+1]);
       pls[2*r+1] = L_NONE; p_free(ppg[2*r+1]); retire(r) }
#endif
#if defined(SOURCE_HOLD) && !defined(QUARANTINE)
  /* a held page outlives the bound and is released blindly */
  :: d_step { pls[2*r] == L_HELD && KBUSY(r,0) ->
       printf("r%d: prefill hold of page %d times out: @PagedTokenToKVPoolAllocator_free anyway\n", r, ppg[2*r]);
       pls[2*r] = L_NONE; p_free(ppg[2*r]); retire(r) }
  :: d_step { pls[2*r+1] == L_HELD && KBUSY(r,1) ->
       printf("r%d: prefill hold of page %d times out: @PagedTokenToKVPoolAllocator_free anyway\n", r, ppg[2*r+1]);
       pls[2*r+1] = L_NONE; p_free(ppg[2*r+1]); retire(r) }
#endif
#if defined(SOURCE_HOLD) && defined(QUARANTINE) && defined(PEER_NEVER_RESUMES)
  :: d_step { pls[2*r] == L_HELD && KBUSY(r,0) ->
       printf("r%d: prefill page %d held past the bound: quarantined\n", r, ppg[2*r]);
       pls[2*r] = L_QUAR }
  :: d_step { pls[2*r+1] == L_HELD && KBUSY(r,1) ->
       printf("r%d: prefill page %d held past the bound: quarantined\n", r, ppg[2*r+1]);
       pls[2*r+1] = L_QUAR }
#endif
  od
}

/* ================================================================ decode scheduler */

/* which two pages decode's allocator hands out: each the lowest clean page or any free
 * page that is not clean */
inline d_pick() {
  d_step {
    pa = NOPAGE;
    for (q : 0 .. NPAGE-1) { if :: pa == NOPAGE && DCLEAN(q) -> pa = q :: else fi };
    q = 0
  };
  if
  :: pa != NOPAGE
  PICK(DDIRTY, pa)
  fi;
  d_step {
    pb = NOPAGE;
    for (q : 0 .. NPAGE-1) { if :: pb == NOPAGE && q != pa && DCLEAN(q) -> pb = q :: else fi };
    q = 0
  };
  if
  :: pb != NOPAGE
  PICK(DDIRTY2, pb)
  fi
}

#if defined(REL_0523)
#define SETTLE_MSG "r%d: decode @DecodeTransferQueue_resolve_deferred_releases: ABORT_ACK in, pages %d,%d given back\n"
#define EXPIRE_MSG "r%d: decode @DecodeTransferQueue_resolve_deferred_releases: deferred release timed out, releasing pages %d,%d anyway\n"
#else
#define SETTLE_MSG "r%d: decode: every prefill rank drained; held pages %d,%d -> @PagedTokenToKVPoolAllocator_free\n"
#define EXPIRE_MSG "r%d: decode hold times out: pages %d,%d -> @PagedTokenToKVPoolAllocator_free anyway\n"
#endif

proctype Decode_scheduler(byte r)
{
end:
  do
  /* reserve the whole prompt, tell prefill where to write */
  :: atomic { dst[r] == D_QUEUED && rs[r] == R_LIVE && D_TWO_FREE ->
       d_pick();
       d_step {
       dfree[pa] = dfree[pa] - 1;
       dfree[pb] = dfree[pb] - 1;
       printf("r%d: decode @DecodePreallocQueue_pop_preallocated -> @DecodePreallocQueue__pre_alloc pages %d,%d (@PagedTokenToKVPoolAllocator_alloc); @MooncakeKVReceiver_send_metadata\n", r, pa, pb);
#ifdef PROP_REUSE_DST
       assert(!D_BUSY(pa) && !D_BUSY(pb));       /* no reuse under a transfer (decode page) */
#endif
       dpg[2*r] = pa; dpg[2*r+1] = pb;
       dl[r] = L_LIVE; stale[r] = 0;
#ifdef CANARY
       dcont[pa] = CANVAL(r); dcont[pb] = CANVAL(r);
       printf("  destination_canary stamps pages %d,%d\n", pa, pb);
#else
       /* whatever was there is not r's KV (unless another owner still reads it) */
       if :: !D_OWNED(pa) -> dcont[pa] = 0 :: else fi;
       if :: !D_OWNED(pb) -> dcont[pb] = 0 :: else fi;
#endif
       dst[r] = D_RESERVED;
       pa = 0; pb = 0 } }

  /* CommonKVReceiver waiting timeout (the clock starts at send_metadata) */
  :: d_step { dst[r] == D_RESERVED && rs[r] == R_LIVE ->
       printf("r%d: decode @DecodeTransferQueue_pop_transferred: waiting timeout -> Failed, ABORT to prefill\n", r);
       fail_room(r); retire(r) }

  /* Success: @DecodeTransferQueue__commit_transfer_to_req with kvguard's checks */
  :: d_step { dst[r] == D_RESERVED && rs[r] == R_SUCCESS ->
       printf("r%d: decode @DecodeTransferQueue_pop_transferred: Success -> @DecodeTransferQueue__commit_transfer_to_req\n", r);
       bad = 0;
#ifdef COVERAGE
       if :: stub[r] -> bad = 1; printf("  transfer_coverage: prefill sent 1 page, decode reserved 2\n") :: else fi;
#endif
#ifdef CANARY
       if
       :: dcont[dpg[2*r]] == CANVAL(r) || dcont[dpg[2*r+1]] == CANVAL(r) ->
          bad = 1; printf("  destination_canary: a reserved page was never written\n")
       :: else
       fi;
#endif
#ifdef CHECKSUM
       if
       :: stub[r] || dcont[dpg[2*r]] != KVP(r,0) || dcont[dpg[2*r+1]] != KVP(r,1) ->
          bad = 1; printf("  transfer_checksum: the digest over the reserved pages differs from prefill's\n")
       :: else
       fi;
#endif
       if
       :: bad ->
          printf("  @prepare_abort r%d: 500, fail closed; @PagedTokenToKVPoolAllocator_free pages (transfer complete)\n", r);
          answer(r, A_500); d_release(r); dst[r] = D_DONE
       :: else -> dst[r] = D_RUNNING
       fi;
       bad = 0; retire(r) }

  /* decode steps over its pages and answers */
  :: d_step { dst[r] == D_RUNNING ->
       printf("r%d: decode @Scheduler_update_running_batch reads its pages %d, %d\n", r, dpg[2*r], dpg[2*r+1]);
       show_dpage(dpg[2*r]); show_dpage(dpg[2*r+1]);
#ifdef GENERATION
       if
       :: stale[r] != 0 ->
          printf("  page_generation: a page changed generation -> 500; free only the pages it still owns\n");
          answer(r, A_500);
          dl[r] = L_NONE;
          if :: !(stale[r] & 1) -> d_free(dpg[2*r])   :: else fi;
          if :: !(stale[r] & 2) -> d_free(dpg[2*r+1]) :: else fi;
          stale[r] = 0;
          dst[r] = D_DONE
       :: else
       fi;
#endif
       if
       :: dst[r] == D_RUNNING ->
#ifdef PROP_UAF
          assert(stale[r] == 0);                   /* never reads a page freed under it */
#endif
          printf("  r%d done: @SchedulerOutputStreamer_stream_output\n", r);
#ifdef PROP_ISOLATION
          assert(dcont[dpg[2*r]] == KVP(r,0) && dcont[dpg[2*r+1]] == KVP(r,1));   /* isolation */
#endif
          answer(r, A_200);
          d_release(r);
          dst[r] = D_DONE
       :: else
       fi;
       retire(r) }

#if (defined(REL_0523) || defined(DEST_HOLD)) && !defined(MERGE_DSETTLE)
  /* held pages of a failed room go back once it drained */
  :: d_step { D_HOLDS(r) && D_DRAINED(r) ->
       printf(SETTLE_MSG, r, dpg[2*r], dpg[2*r+1]); d_release(r); retire(r) }
#endif
#if (defined(REL_0523) || defined(DEST_HOLD)) && !defined(QUARANTINE)
  /* the hold outlives its bound (0.5.23: 30 s) and the pages are released blindly */
  :: d_step { dl[r] == L_HELD && !D_DRAINED(r) ->
       printf(EXPIRE_MSG, r, dpg[2*r], dpg[2*r+1]); d_release(r); retire(r) }
#endif
#if (defined(REL_0523) || defined(DEST_HOLD)) && defined(QUARANTINE) && defined(PEER_NEVER_RESUMES)
  :: d_step { dl[r] == L_HELD && !D_DRAINED(r) ->
       printf("r%d: decode hold of pages %d,%d past the bound: quarantined, never freed blind\n", r, dpg[2*r], dpg[2*r+1]);
       dl[r] = L_QUAR;
#ifdef REACH_QUARANTINE
       assert(false);
#endif
       skip }
#endif
  od
}

/* ================================================================ transfer engine (Mooncake) */

/* held pages go back in the step that drained them (the MERGE_* reductions); pa is the
 * chunk's source page */
inline settle(r, c) {
#ifdef MERGE_PSETTLE
  if
  :: HOLDING(pls[2*r+c]) && !KBUSY(r,c) ->
     printf("  prefill @PrefillBootstrapQueue_pop_bootstrapped gives back held page %d\n", pa);
#ifdef REACH_DEAD_RELEASE
     assert(CH(r,c) != C_DEAD);     /* a page held for a dead peer's batch comes back */
#endif
     pls[2*r+c] = L_NONE; p_free(pa)
  :: else
  fi;
#endif
#ifdef MERGE_DSETTLE
  if
  :: D_HOLDS(r) && D_DRAINED(r) && (CH(r,0) == C_DEAD || CH(r,1) == C_DEAD) ->
     printf("  decode: peer_liveness confirms the room's prefill peer gone; held pages %d,%d -> @PagedTokenToKVPoolAllocator_free\n", dpg[2*r], dpg[2*r+1]);
     d_release(r)
  :: D_HOLDS(r) && D_DRAINED(r) -> printf(SETTLE_MSG, r, dpg[2*r], dpg[2*r+1]); d_release(r)
  :: else
  fi;
#endif
  skip
}

/* the batch of chunk (r,c) lands: it reads the source page now, writes the destination */
inline land(r, c) {
  pa = ppg[2*r+c]; pb = dpg[2*r+c];
  if
  :: CH(r,c) == C_TIMEDOUT -> printf("r%d: the peer resumes: chunk %d's failed batch still lands\n", r, c)
  :: else
  fi;
  printf("r%d: @MooncakeKVManager_transfer_worker -> @MooncakeKVManager__transfer_data chunk %d lands: prefill page %d -> decode page %d\n", r, c, pa, pb);
  show_ppage(pa);
#ifdef PROP_LATEWRITE
  for (q : 1 .. NREQ) {
    assert(q == r || !D_OWNED1(q, pb))          /* no write into a page another request owns */
  };
  q = 0;
#endif
#ifdef REACH_LATE_INTO_HELD
  assert(!(CH(r,c) == C_TIMEDOUT && D_HOLDS(r)));
#endif
  dcont[pb] = pcont[pa];
  if :: !D_OWNED(pb) -> dcont[pb] = 0 :: else fi;     /* dead value */
  CH(r,c) = C_DONE;
  if :: !P_READ(pa) -> pcont[pa] = 0 :: else fi;      /* dead value */
  settle(r, c);
  if
  :: rs[r] == R_LIVE && pst[r] == P_SENT && CH(r,0) == C_DONE && CH(r,1) == C_DONE ->
     rs[r] = R_SUCCESS;
     printf("  @CommonKVManager_update_status r%d Success; prefill inflight queue frees its source pages\n", r);
     p_release_chunk(r, 0); p_release_chunk(r, 1); pst[r] = P_DONE
  :: else
  fi;
  pa = 0; pb = 0
}

/* the peer of chunk (r,c)'s failed batch vanishes (process gone): the batch never
 * lands.  peer_liveness (PEER_LIVENESS) sees the peer's session port refuse connections
 * and lets the holds go; without it the batch looks unsettled for ever. */
inline die(r, c) {
  pa = ppg[2*r+c];
  printf("r%d: the peer of chunk %d's failed batch is gone: the batch never lands\n", r, c);
  CH(r,c) = C_DEAD;
  if :: !P_READ(pa) -> pcont[pa] = 0 :: else fi;      /* dead value */
#ifdef PEER_LIVENESS
  printf("  peer_liveness: the peer's session port refuses connections (confirmed gone)\n");
#endif
  settle(r, c);
  pa = 0
}

#ifdef PEER_NEVER_RESUMES
#define CAN_LAND(r,c) (CH(r,c) == C_INFLIGHT)
#else
#define CAN_LAND(r,c) (BUSY(r,c))
#endif

proctype Transfer_engine(byte r)
{
end:
  do
  :: d_step { CAN_LAND(r,0) -> land(r, 0); retire(r) }
  :: d_step { CAN_LAND(r,1) -> land(r, 1); retire(r) }
  /* Mooncake's sync write times out (frozen peer): the worker reports Failed and moves
   * on; the batch keeps running and may land later */
  :: d_step { CH(r,0) == C_INFLIGHT ->
       printf("r%d: @MooncakeKVManager__transfer_data chunk 0 returns -1 (peer frozen); the batch still runs\n", r);
       CH(r,0) = C_TIMEDOUT;
       if :: rs[r] == R_LIVE -> printf("  @CommonKVManager_update_status r%d Failed\n", r); fail_room(r) :: else fi;
       retire(r) }
  :: d_step { CH(r,1) == C_INFLIGHT ->
       printf("r%d: @MooncakeKVManager__transfer_data chunk 1 returns -1 (peer frozen); the batch still runs\n", r);
       CH(r,1) = C_TIMEDOUT;
       if :: rs[r] == R_LIVE -> printf("  @CommonKVManager_update_status r%d Failed\n", r); fail_room(r) :: else fi;
       retire(r) }
#ifdef PEER_CAN_DIE
  :: d_step { CH(r,0) == C_TIMEDOUT -> die(r, 0); retire(r) }
  :: d_step { CH(r,1) == C_TIMEDOUT -> die(r, 1); retire(r) }
#endif
  od
}

/* ================================================================ operator: /flush_cache */

#define P_IDLE1(r)   (!P_ACTIVE(r))
#define P_NOHOLD1(r) (!P_HOLDS(r))
#define D_IDLE1(r)   (!D_ACTIVE(r))
#define D_NOHOLD1(r) (!D_HOLDS(r))
#ifdef FLUSH_BARRIER
#define P_FLUSH_OK (FORALL(P_IDLE1) && FORALL(P_NOHOLD1))
#else
#define P_FLUSH_OK (FORALL(P_IDLE1))
#endif
#if defined(FLUSH_BARRIER) || defined(REL_0523)
/* 0.5.23's idle test counts its deferred releases; flush_barrier counts kvguard's holds */
#define D_FLUSH_OK (FORALL(D_IDLE1) && FORALL(D_NOHOLD1))
#else
#define D_FLUSH_OK (FORALL(D_IDLE1))
#endif

active proctype Operator()
{
end:
  do
  :: d_step { !flushed_p && P_FLUSH_OK ->
       printf("prefill @Scheduler_flush_cache: @Scheduler_is_fully_idle says idle; allocator reset\n");
       flushed_p = 1;
       for (pa : 0 .. NPAGE-1) { pfree[pa] = 1 };
       pa = 0 }
  :: d_step { !flushed_d && D_FLUSH_OK ->
       printf("decode @Scheduler_flush_cache: @Scheduler_is_fully_idle says idle; allocator reset\n");
       flushed_d = 1;
       for (pa : 0 .. NPAGE-1) { dfree[pa] = 1 };
       pa = 0;
#ifdef REACH_FLUSH
       assert(!(flushed_p && answered[2]));     /* both nodes flushed after a request ended */
#endif
       skip }
  od
}

init {
  atomic {
    q = 1;
    do
    :: q <= NREQ ->
       run Client_router(q); run Prefill_scheduler(q); run Decode_scheduler(q); run Transfer_engine(q);
       q++
    :: else -> break
    od;
    q = 0
  }
}

/* ================================================================ properties over states */
#ifdef PROP_TERMINAL
active proctype Terminal()
{
  timeout -> assert(ALLDONE)       /* no run stops with a request unanswered or a page owned or held */
}
#endif

#ifdef PROGRESS
ltl progress { <> (ALLDONE) }
#elif defined(PROP_CONSERVATION)
never {      /* checked after every step: free + owned + held + quarantined == pool, page by page */
  do
  :: assert(CONSERVED)
  od
}
#endif
