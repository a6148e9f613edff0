package tokensvc

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io/ioutil"
	"time"

	tokensvcv1 "github.com/ctxmesh/tokensvc/clients/go/gen/tokensvc/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
)

// DefaultTimeout is the deadline of a unary call whose context has none.
const DefaultTimeout = 10 * time.Second

// Config says where tokensvc is and how to prove who is calling.
type Config struct {
	// Target is tokensvc's address, host:port (for example "tokensvc.ctxmesh-system:50051").
	Target string

	// CAFile, CertFile and KeyFile are PEM files: the CA bundle the server's certificate must chain
	// to, and this caller's certificate chain and private key. Ignored when Credentials is set.
	CAFile, CertFile, KeyFile string
	// ServerName is the name to verify on the server's certificate when it is not Target's host.
	ServerName string
	// Credentials, when set, replaces the PEM files: for example the credentials of a SPIFFE
	// workload-API X.509 source, which rotate without redialling. They must authenticate the
	// caller with a client certificate: tokensvc refuses a connection without one.
	Credentials credentials.TransportCredentials

	// Capability returns the run capability (a compact JWS) to send on every call; a launcher
	// returns the one its run was issued. Nil for admin callers, whose calls take none.
	Capability func(ctx context.Context) (string, error)

	// Timeout is the deadline of a unary call whose context has none; DefaultTimeout when zero.
	Timeout time.Duration

	// DialOptions are appended to the client's own (for example grpc.WithBlock()).
	DialOptions []grpc.DialOption
}

// StaticCapability is a Config.Capability that always sends the same token.
func StaticCapability(token string) func(context.Context) (string, error) {
	return func(context.Context) (string, error) { return token, nil }
}

// Client is a connection to tokensvc with its services' stubs. It is safe for concurrent use.
type Client struct {
	conn *grpc.ClientConn

	Capability  tokensvcv1.CapabilityServiceClient
	Memory      tokensvcv1.MemoryServiceClient
	Knowledge   tokensvcv1.KnowledgeServiceClient
	Admin       tokensvcv1.AdminServiceClient
	Migration   tokensvcv1.MigrationServiceClient
	DataSubject tokensvcv1.DataSubjectServiceClient
}

// Dial connects to tokensvc. The connection is made lazily unless DialOptions say otherwise.
func Dial(ctx context.Context, config Config) (*Client, error) {
	if config.Target == "" {
		return nil, errors.New("tokensvc: Config.Target is required")
	}
	transport := config.Credentials
	if transport != nil && transport.Info().SecurityProtocol != "tls" {
		return nil, fmt.Errorf("tokensvc: Config.Credentials speak %q: tokensvc takes mutual TLS only",
			transport.Info().SecurityProtocol)
	}
	if transport == nil {
		var err error
		if transport, err = pemCredentials(config); err != nil {
			return nil, err
		}
	}
	timeout := config.Timeout
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	options := []grpc.DialOption{
		grpc.WithTransportCredentials(transport),
		grpc.WithDefaultServiceConfig(serviceConfig),
		grpc.WithUserAgent("tokensvc-go/0.1.0"),
		grpc.WithChainUnaryInterceptor(deadlineInterceptor(timeout), errorInterceptor),
		grpc.WithChainStreamInterceptor(streamErrorInterceptor),
	}
	if config.Capability != nil {
		options = append(options, grpc.WithPerRPCCredentials(capabilityCredentials(config.Capability)))
	}
	conn, err := grpc.DialContext(ctx, config.Target, append(options, config.DialOptions...)...)
	if err != nil {
		return nil, fromError(err)
	}
	return &Client{
		conn:        conn,
		Capability:  tokensvcv1.NewCapabilityServiceClient(conn),
		Memory:      tokensvcv1.NewMemoryServiceClient(conn),
		Knowledge:   tokensvcv1.NewKnowledgeServiceClient(conn),
		Admin:       tokensvcv1.NewAdminServiceClient(conn),
		Migration:   tokensvcv1.NewMigrationServiceClient(conn),
		DataSubject: tokensvcv1.NewDataSubjectServiceClient(conn),
	}, nil
}

// Close closes the connection; calls in flight end with CANCELED.
func (c *Client) Close() error { return c.conn.Close() }

func pemCredentials(config Config) (credentials.TransportCredentials, error) {
	if config.CAFile == "" || config.CertFile == "" || config.KeyFile == "" {
		return nil, errors.New("tokensvc: CAFile, CertFile and KeyFile are required (mTLS only), or Credentials")
	}
	ca, err := ioutil.ReadFile(config.CAFile)
	if err != nil {
		return nil, fmt.Errorf("tokensvc: reading CAFile: %w", err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(ca) {
		return nil, fmt.Errorf("tokensvc: CAFile %s holds no PEM certificate", config.CAFile)
	}
	certificate, err := tls.LoadX509KeyPair(config.CertFile, config.KeyFile)
	if err != nil {
		return nil, fmt.Errorf("tokensvc: loading CertFile and KeyFile: %w", err)
	}
	return credentials.NewTLS(&tls.Config{
		RootCAs:      roots,
		Certificates: []tls.Certificate{certificate},
		ServerName:   config.ServerName,
		MinVersion:   tls.VersionTLS12,
	}), nil
}

// capabilityCredentials sends the run capability on every call, and only on a TLS connection:
// grpc-go checks RequireTransportSecurity once, when dialling, against the transport's kind, so the
// connection each call actually runs on is checked here too.
type capabilityCredentials func(context.Context) (string, error)

func (c capabilityCredentials) GetRequestMetadata(ctx context.Context, _ ...string) (map[string]string, error) {
	if info, ok := credentials.RequestInfoFromContext(ctx); !ok || info.AuthInfo == nil || info.AuthInfo.AuthType() != "tls" {
		return nil, errors.New("tokensvc: refusing to send the run capability over a connection that is not TLS")
	}
	token, err := c(ctx)
	if err != nil {
		return nil, fmt.Errorf("tokensvc: getting the run capability: %w", err)
	}
	if token == "" {
		return nil, errors.New("tokensvc: the run capability is empty")
	}
	return map[string]string{"authorization": "Bearer " + token}, nil
}

func (capabilityCredentials) RequireTransportSecurity() bool { return true }

func deadlineInterceptor(timeout time.Duration) grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply interface{}, cc *grpc.ClientConn,
		invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if _, ok := ctx.Deadline(); !ok {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, timeout)
			defer cancel()
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	}
}

func errorInterceptor(ctx context.Context, method string, req, reply interface{}, cc *grpc.ClientConn,
	invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	return fromError(invoker(ctx, method, req, reply, cc, opts...))
}

func streamErrorInterceptor(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string,
	streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	stream, err := streamer(ctx, desc, cc, method, opts...)
	if err != nil {
		return nil, fromError(err)
	}
	return errorStream{stream}, nil
}

// errorStream turns a stream's failures into *Error; io.EOF passes through unchanged.
type errorStream struct{ grpc.ClientStream }

func (s errorStream) SendMsg(m interface{}) error { return fromError(s.ClientStream.SendMsg(m)) }
func (s errorStream) RecvMsg(m interface{}) error { return fromError(s.ClientStream.RecvMsg(m)) }
func (s errorStream) CloseSend() error            { return fromError(s.ClientStream.CloseSend()) }
