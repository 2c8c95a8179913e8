package vsock

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Hybrid is the "hybrid vsock" face of Firecracker and Cloud Hypervisor
// (Firecracker docs/vsock.md) over a Device: a Unix socket at Path where
// a host program connects and writes "CONNECT <port>\n" to reach the
// guest's listener on port (the answer is "OK <host port>\n", then the
// stream), and, for the guest's connections to host port P, a connection
// to the Unix socket at Path_P, if one listens there (else RST): a
// socket of this process's user, not reached through a symlink.
type Hybrid struct {
	d    *Device
	path string
	ul   *net.UnixListener
	any  *Listener
	wg   sync.WaitGroup

	mu    sync.Mutex
	conns map[io.Closer]bool
}

// handshakeTimeout bounds a host program's CONNECT line and the guest's
// answer to it.
const handshakeTimeout = 5 * time.Second

// ServeHybrid listens at path and forwards until Close.
func ServeHybrid(d *Device, path string) (*Hybrid, error) {
	ul, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, err
	}
	h := &Hybrid{d: d, path: path, ul: ul, conns: map[io.Closer]bool{}}
	h.any, err = d.ListenAny(func(port uint32) bool {
		return isOwnedSocket(h.portPath(port))
	})
	if err != nil {
		ul.Close()
		return nil, err
	}
	h.wg.Add(2)
	go h.serveHost()
	go h.serveGuest()
	return h, nil
}

// ServeHybridGuest is ServeHybrid's guest face alone, for the host ports
// given: the guest's connection to one of them, P, goes to the Unix
// socket at path_P if one is there (else RST). Nothing listens at path:
// no host program reaches the guest through it. shunt-vsockd hands a
// VM's control channel and stretches to hostd so (hostd/vsockd).
func ServeHybridGuest(d *Device, path string, ports ...uint32) (*Hybrid, error) {
	want := map[uint32]bool{}
	for _, p := range ports {
		want[p] = true
	}
	h := &Hybrid{d: d, path: path, conns: map[io.Closer]bool{}}
	var err error
	h.any, err = d.ListenAny(func(port uint32) bool {
		if !want[port] {
			return false
		}
		return isOwnedSocket(h.portPath(port))
	})
	if err != nil {
		return nil, err
	}
	h.wg.Add(1)
	go h.serveGuest()
	return h, nil
}

func (h *Hybrid) portPath(port uint32) string {
	return h.path + "_" + strconv.FormatUint(uint64(port), 10)
}

// Close stops both faces and ends the streams they carry.
func (h *Hybrid) Close() error {
	if h.ul != nil {
		h.ul.Close()
	}
	h.any.Close()
	h.mu.Lock()
	for c := range h.conns {
		c.Close()
	}
	h.conns = nil
	h.mu.Unlock()
	h.wg.Wait()
	return nil
}

func (h *Hybrid) track(cs ...io.Closer) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.conns == nil {
		return false
	}
	for _, c := range cs {
		h.conns[c] = true
	}
	return true
}

func (h *Hybrid) untrack(cs ...io.Closer) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, c := range cs {
		delete(h.conns, c)
		c.Close()
	}
}

func (h *Hybrid) serveHost() {
	defer h.wg.Done()
	for {
		u, err := h.ul.AcceptUnix()
		if err != nil {
			return
		}
		h.wg.Add(1)
		go func() {
			defer h.wg.Done()
			h.hostConn(u)
		}()
	}
}

// hostConn reads "CONNECT <port>\n", dials the guest and answers
// "OK <host port>\n"; on failure it closes the connection, as Firecracker
// does.
func (h *Hybrid) hostConn(u *net.UnixConn) {
	if !h.track(u) {
		u.Close()
		return
	}
	_ = u.SetReadDeadline(time.Now().Add(handshakeTimeout))
	// At most a line of 64 bytes; what follows it is the stream's.
	r := bufio.NewReaderSize(io.LimitReader(u, 64), 64)
	line, err := r.ReadString('\n')
	port, perr := parseConnect(line)
	if err != nil || perr != nil {
		h.untrack(u)
		return
	}
	_ = u.SetReadDeadline(time.Time{})
	ctx, cancel := context.WithTimeout(context.Background(), handshakeTimeout)
	c, err := h.d.Dial(ctx, port)
	cancel()
	if err != nil {
		h.untrack(u)
		return
	}
	if !h.track(c) {
		c.Close()
		h.untrack(u)
		return
	}
	if _, err := fmt.Fprintf(u, "OK %d\n", c.LocalAddr().(*Addr).Port); err != nil {
		h.untrack(u, c)
		return
	}
	// Bytes the host sent right after its CONNECT line came with it.
	if n := r.Buffered(); n > 0 {
		rest, _ := r.Peek(n)
		if _, err := c.Write(rest); err != nil {
			h.untrack(u, c)
			return
		}
	}
	h.splice(u, c)
}

// parseConnect parses "CONNECT <port>\n".
func parseConnect(line string) (uint32, error) {
	f := strings.Fields(line)
	if len(f) != 2 || f[0] != "CONNECT" || !strings.HasSuffix(line, "\n") {
		return 0, fmt.Errorf("want \"CONNECT <port>\\n\", got %q", line)
	}
	p, err := strconv.ParseUint(f[1], 10, 32)
	return uint32(p), err
}

func (h *Hybrid) serveGuest() {
	defer h.wg.Done()
	for {
		c, err := h.any.AcceptContext(context.Background())
		if err != nil {
			return
		}
		h.wg.Add(1)
		go func() {
			defer h.wg.Done()
			path := h.portPath(c.LocalAddr().(*Addr).Port)
			ctx, cancel := context.WithTimeout(context.Background(), handshakeTimeout)
			u, err := dialOwned(ctx, path)
			cancel()
			if err != nil {
				h.d.log("vsock cid %d: hybrid: %v", h.d.cid, err)
				c.Close()
				return
			}
			if !h.track(u, c) {
				u.Close()
				c.Close()
				return
			}
			h.splice(u, c)
		}()
	}
}

// splice copies both ways, passing each half-close on, and closes both
// when both directions ended, or at once when one failed (a reset).
func (h *Hybrid) splice(u *net.UnixConn, c *Conn) {
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		if _, err := io.Copy(c, u); err != nil {
			h.untrack(u, c)
			return
		}
		_ = c.CloseWrite()
	}()
	go func() {
		defer wg.Done()
		if _, err := io.Copy(u, c); err != nil {
			h.untrack(u, c)
			return
		}
		_ = u.CloseWrite()
	}()
	wg.Wait()
	h.untrack(u, c)
}
