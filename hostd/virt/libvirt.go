package virt

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/digitalocean/go-libvirt"
	"github.com/digitalocean/go-libvirt/socket/dialers"
)

// Dial returns a dial function for NewWatcher that connects to the
// libvirtd listening on socket and opens uri (e.g. "qemu:///system").
func Dial(socket, uri string) func(context.Context) (Source, error) {
	return func(ctx context.Context) (Source, error) {
		timeout := 5 * time.Second
		if dl, ok := ctx.Deadline(); ok {
			timeout = max(time.Until(dl), time.Millisecond)
		}
		l := libvirt.NewWithDialer(dialers.NewLocal(dialers.WithSocket(socket), dialers.WithLocalTimeout(timeout)))
		if err := l.ConnectToURI(libvirt.ConnectURI(uri)); err != nil {
			return nil, fmt.Errorf("connect to libvirtd at %s (%s): %w; is libvirtd running?", socket, uri, err)
		}
		lctx, cancel := context.WithCancel(context.Background())
		evs, err := l.LifecycleEvents(lctx)
		if err != nil {
			cancel()
			_ = l.Disconnect()
			return nil, fmt.Errorf("subscribe to libvirt lifecycle events: %w", err)
		}
		s := &source{l: l, cancel: cancel, events: make(chan struct{}, 1)}
		go s.forward(evs)
		return s, nil
	}
}

// source is a Source over go-libvirt.
type source struct {
	l      *libvirt.Libvirt
	cancel context.CancelFunc
	events chan struct{}
}

func (s *source) forward(evs <-chan libvirt.DomainEventLifecycleMsg) {
	defer close(s.events)
	for {
		select {
		case _, ok := <-evs:
			if !ok {
				return
			}
			select {
			case s.events <- struct{}{}:
			default: // one pending wake-up covers any number of events
			}
		case <-s.l.Disconnected():
			return
		}
	}
}

func (s *source) Events() <-chan struct{} { return s.events }

func (s *source) Active() (map[string][]byte, error) {
	doms, _, err := s.l.ConnectListAllDomains(1, libvirt.ConnectListDomainsActive)
	if err != nil {
		return nil, fmt.Errorf("list libvirt domains: %w", err)
	}
	out := make(map[string][]byte, len(doms))
	for _, d := range doms {
		x, err := s.l.DomainGetXMLDesc(d, 0)
		if err != nil {
			if libvirt.IsNotFound(err) {
				continue // gone between the list and now; the next event tells
			}
			return nil, fmt.Errorf("XML of domain %s: %w", d.Name, err)
		}
		out[d.Name] = []byte(x)
	}
	return out, nil
}

func (s *source) Close() error {
	s.cancel()
	err := s.l.Disconnect()
	if errors.Is(err, context.Canceled) {
		err = nil
	}
	return err
}
