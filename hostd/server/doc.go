// Package server runs hostd's control channels: one Unix socket per guest
// (as one virtio-serial port per VM), so a guest's identity is the socket it
// connected to, never something it claims. Each connection is a session;
// several processes of one guest (MPI ranks in one container) each have one.
// The protocol is internal/proto's (docs/protocol.md); what a session asks
// for is the broker's to decide (hostd/broker).
//
// A session has two steps: the handshake, until HELLO, and then dispatch,
// one message at a time in the order the guest sent them, so that a PONG
// answers for everything said before its PING:
//
//	connect --> handshake --HELLO/WELCOME--> dispatch --EOF, reset--> detached
//	            |                            |
//	            | guest message: ERROR       | LISTEN, INTENT, OPEN, CLOSE, LEFT,
//	            |   (no-hostd), keep going   |   REATTACH, KICK: to the broker
//	            | other: ERROR(malformed),   | PING: PONG
//	            |   close                    | HELLO: WELCOME again; after the
//	            |                            |   guest acted, a new guest on the
//	            |                            |   channel: the old one is gone
//	            |                            | malformed, or a message only
//	            |                            |   hostd sends: ERROR, close
//
// HELLO says what the guest library speaks: the session answers in its
// protocol version (2 or 3), WELCOME names the ring format hostd chose
// (0: none in common), and a session that is not version 3 with a common
// format tells the broker so (Switching), which answers its OPENs with
// TCP(version).
//
// A guest message before HELLO means the guest still talks to an earlier
// hostd (a VM's port stays open across a restart): ERROR(no-hostd) asks it
// to say HELLO again. A malformed frame gets ERROR(malformed) after the
// replies already queued, and the session is closed, logged and counted;
// other sessions and guests are unaffected. A session that ends (EOF, reset,
// Remove) is detached from the broker, which moves the other end of each
// of its connections to TCP (DOWN(peer-gone)); Close ends
// every session without detaching them, since hostd stopping is not the
// guests going away.
//
// No guest can starve the others of the control plane (Options, hostd.hcl's
// limits block): a guest's sessions are capped (beyond: ERROR(control-limit)
// and a close) and paced (beyond SessionRate a second they wait in its
// socket's backlog); an accept that fails (EMFILE) is retried with backoff,
// never given up. Every session has a keepalive: hostd PINGs a guest quiet
// for Keepalive and closes one silent for Silence, and every read (HELLO
// included, and any frame once begun) and write has a deadline that follows
// it, so a guest that never reads, or stops mid-frame, loses only its own
// session. Replies wait in a bounded queue; while it is over half full the
// session stops reading the guest's requests. KICKs relayed from a flow's
// peer wait in their own lane, at most one per flow side, so a peer's KICK
// flood can never fill the queue. Repeated failures of one guest's sessions
// are logged once a minute, and all are counted.
//
// Files: server.go (sockets, accepting with backoff and pacing, the session
// limit, Close), session.go (one session: handshake, dispatch, keepalive and
// deadlines, the queue, the KICK lane and the writer).
package server
