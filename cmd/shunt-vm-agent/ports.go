//go:build linux

package main

import (
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/shuntnet/shunt/guestlib"
)

// The port-sharing modes: several guestlib clients in one VM, as several
// programs would be, each taking a control port of its own (docs/vm.md,
// "Discovery").
//
//	port-clients ADDR N BYTES  N clients with guestlib's defaults, made one
//	                           after the other; each dials ADDR and says
//	                           "CLIENT i PORT p PATH path" (p: the port it
//	                           took, or "none"), then all send BYTES
//	                           (seeded) at once, half-close and say
//	                           "CLIENT i SENT n crc"
//	accept-many PORT N         accept N connections and read each to EOF:
//	                           "RECV n crc" per connection
func init() {
	streamModes["port-clients"] = portClients
	streamModes["accept-many"] = acceptMany
}

// portClients leaves the agent's client alone (it takes no port unless
// used) and makes its own, each logging with its number.
func portClients(_ *guestlib.Client, args []string) error {
	if len(args) != 3 {
		return errors.New("usage: port-clients ADDR N BYTES")
	}
	n, err := strconv.Atoi(args[1])
	if err != nil {
		return fmt.Errorf("count %q: %w", args[1], err)
	}
	total, err := strconv.Atoi(args[2])
	if err != nil {
		return fmt.Errorf("BYTES %q: %w", args[2], err)
	}
	conns := make([]*guestlib.Conn, n)
	for i := range n {
		port := make(chan string, 1)
		logf := func(f string, a ...any) {
			line := fmt.Sprintf(f, a...)
			say("LOG%d %s", i, line)
			if p, ok := strings.CutPrefix(line, "shunt: control port "); ok {
				select {
				case port <- p:
				default:
				}
			}
		}
		c, err := guestlib.NewClient(guestlib.Options{Logf: logf})
		if err != nil {
			return err
		}
		conn, err := (&guestlib.Dialer{Client: c}).DialContext(context.Background(), "tcp4", args[0])
		if err != nil {
			return err
		}
		// The path once hostd answered, past the provisional answers (or
		// at once without a port); the next client comes after. Under
		// TCG READY can take a while.
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		p := conn.WaitPath(ctx)
		for !p.Fast && provisional[p.Reason] && ctx.Err() == nil {
			time.Sleep(10 * time.Millisecond)
			p = conn.Path()
		}
		cancel()
		got := "none"
		select {
		case got = <-port:
		default:
		}
		say("CLIENT %d PORT %s PATH %s", i, got, p)
		conns[i] = conn
	}
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i, conn := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sum, err := sendSeeded(conn, total)
			if err == nil {
				err = conn.CloseWrite()
			}
			if err == nil {
				_, err = io.Copy(io.Discard, conn) // the server closes after EOF
			}
			if err != nil {
				errs[i] = fmt.Errorf("client %d: %w", i, err)
				return
			}
			say("CLIENT %d SENT %d %d", i, total, sum)
			conn.Close()
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// sendSeeded writes total bytes of the client mode's seeded stream and
// returns their CRC-32.
func sendSeeded(conn *guestlib.Conn, total int) (uint32, error) {
	p := pattern(5)
	var sum uint32
	for off := 0; off < total; {
		at := off % period
		b := p[at : at+min(total-off, maxChunk)]
		if _, err := conn.Write(b); err != nil {
			return 0, err
		}
		sum = crc32.Update(sum, crc32.IEEETable, b)
		off += len(b)
	}
	return sum, nil
}

func acceptMany(c *guestlib.Client, args []string) error {
	if len(args) != 2 {
		return errors.New("usage: accept-many PORT N")
	}
	n, err := strconv.Atoi(args[1])
	if err != nil {
		return fmt.Errorf("count %q: %w", args[1], err)
	}
	l, err := (&guestlib.ListenConfig{Client: c}).Listen(context.Background(), "tcp4", ":"+args[0])
	if err != nil {
		return err
	}
	say("LISTENING")
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		conn, err := l.AcceptShunt()
		if err != nil {
			return err
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			h := crc32.NewIEEE()
			m, err := io.Copy(h, conn)
			if err != nil {
				errs[i] = err
				return
			}
			say("RECV %d %d", m, h.Sum32())
			errs[i] = conn.Close()
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}
