package tokensvc_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"io/ioutil"
	"net"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	tokensvc "github.com/ctxmesh/tokensvc/clients/go"
	tokensvcv1 "github.com/ctxmesh/tokensvc/clients/go/gen/tokensvc/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"
)

// flakyServer answers UNAVAILABLE to the first `failures` calls of each method, then succeeds:
// a tokensvc replica whose database is briefly away. tokensvc itself cannot be made to fail on
// demand, so the retry policy is tested against this server, over the same mTLS.
type flakyServer struct {
	tokensvcv1.UnimplementedCapabilityServiceServer
	tokensvcv1.UnimplementedMemoryServiceServer
	failures               int32
	verifyCalls, remembers int32
}

func (s *flakyServer) VerifyCapability(context.Context, *tokensvcv1.VerifyCapabilityRequest) (*tokensvcv1.VerifyCapabilityResponse, error) {
	if atomic.AddInt32(&s.verifyCalls, 1) <= s.failures {
		return nil, status.Error(codes.Unavailable, "database unavailable")
	}
	return &tokensvcv1.VerifyCapabilityResponse{}, nil
}

func (s *flakyServer) Remember(context.Context, *tokensvcv1.RememberRequest) (*tokensvcv1.RememberResponse, error) {
	atomic.AddInt32(&s.remembers, 1)
	return nil, status.Error(codes.Unavailable, "database unavailable")
}

func startFlakyServer(t *testing.T, failures int32) (*flakyServer, string) {
	t.Helper()
	certificate, err := tls.LoadX509KeyPair(os.Getenv("TOKENSVC_SERVER_CERT"), os.Getenv("TOKENSVC_SERVER_KEY"))
	if err != nil {
		t.Fatalf("server certificate: %v", err)
	}
	ca, err := ioutil.ReadFile(os.Getenv("TOKENSVC_CA"))
	if err != nil {
		t.Fatal(err)
	}
	clients := x509.NewCertPool()
	clients.AppendCertsFromPEM(ca)
	server := grpc.NewServer(grpc.Creds(credentials.NewTLS(&tls.Config{
		Certificates: []tls.Certificate{certificate},
		ClientCAs:    clients,
		ClientAuth:   tls.RequireAndVerifyClientCert,
	})))
	flaky := &flakyServer{failures: failures}
	tokensvcv1.RegisterCapabilityServiceServer(server, flaky)
	tokensvcv1.RegisterMemoryServiceServer(server, flaky)
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go server.Serve(listener)
	t.Cleanup(server.Stop)
	return flaky, listener.Addr().String()
}

func retriesEnabled(t *testing.T) {
	t.Helper()
	parts := strings.SplitN(grpc.Version, ".", 3)
	minor, _ := strconv.Atoi(parts[1])
	if parts[0] == "1" && minor < 40 && os.Getenv("GRPC_GO_RETRY") != "on" {
		t.Fatalf("grpc-go %s applies retry policies only with GRPC_GO_RETRY=on", grpc.Version)
	}
}

func TestRetriesUnavailableOnIdempotentCallsOnly(t *testing.T) {
	retriesEnabled(t)
	flaky, target := startFlakyServer(t, 2)
	client := dial(t, os.Getenv("TOKENSVC_CAPABILITY"), func(c *tokensvc.Config) { c.Target = target })

	if _, err := client.Capability.VerifyCapability(context.Background(), &tokensvcv1.VerifyCapabilityRequest{}); err != nil {
		t.Fatalf("VerifyCapability after two UNAVAILABLE answers: %v", err)
	}
	if calls := atomic.LoadInt32(&flaky.verifyCalls); calls != 3 {
		t.Fatalf("VerifyCapability reached the server %d times, want 3 (two retries)", calls)
	}

	_, err := client.Memory.Remember(context.Background(), &tokensvcv1.RememberRequest{})
	e := expectError(t, err, codes.Unavailable, "")
	if !e.Retryable() {
		t.Fatalf("UNAVAILABLE is retryable by the caller")
	}
	if calls := atomic.LoadInt32(&flaky.remembers); calls != 1 {
		t.Fatalf("Remember reached the server %d times, want 1 (a write is not retried)", calls)
	}
}

func TestTheCapabilityIsNeverSentWithoutTLS(t *testing.T) {
	_, err := tokensvc.Dial(context.Background(), tokensvc.Config{
		Target:      "127.0.0.1:1",
		Credentials: plaintext{},
		Capability:  tokensvc.StaticCapability("secret"),
	})
	if err == nil || !strings.Contains(err.Error(), "mutual TLS only") {
		t.Fatalf("Dial with plaintext credentials: %v", err)
	}
}

// plaintext is transport credentials that say they are not TLS.
type plaintext struct {
	credentials.TransportCredentials
}

func (plaintext) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: "insecure"}
}
